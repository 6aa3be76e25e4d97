# regen's Airflow image: Apache Airflow 3.3.2 with regen's pinned requirements and the regen
# package (include/) importable by every service. The `gpu` stage adds SGLang in its own venv
# (/opt/sglang), the engine_python of GPU workers.
FROM apache/airflow:3.3.2-python3.11 AS base
COPY requirements.txt constraints.txt /opt/regen/
RUN pip install --no-cache-dir -r /opt/regen/requirements.txt -c /opt/regen/constraints.txt
COPY --chown=airflow:root include/ /opt/airflow/include/
COPY --chown=airflow:root dags/ /opt/airflow/dags/
COPY --chown=airflow:root plugins/ /opt/airflow/plugins/
ENV PYTHONPATH=/opt/airflow/include

FROM base AS gpu
COPY requirements-gpu.txt /opt/regen/
USER root
RUN python -m venv /opt/sglang && /opt/sglang/bin/pip install --no-cache-dir -r /opt/regen/requirements-gpu.txt \
    && chown -R airflow:root /opt/sglang
USER airflow
