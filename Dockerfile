# regen's Airflow images, built by docker-compose.yaml.
#
# base: Apache Airflow 3.3.2 with regen's pinned requirements and the regen package (include/),
#       importable by every service and installed as the `regen` command.
# gpu:  SGLang's own CUDA image (its CUDA toolkit, kernels and SGLang in the image's python3: the
#       engine_python of GPU workers), with Airflow, regen and a Celery worker in a venv beside it,
#       run as the same uid (50000) as the other services. SGLANG_VERSION picks the image; keep it at
#       requirements-gpu.txt's pin, the version whose launch flags preflight checks.
ARG SGLANG_VERSION=0.5.23

FROM apache/airflow:3.3.2-python3.11 AS base
COPY requirements.txt constraints.txt pyproject.toml /opt/regen/
RUN pip install --no-cache-dir -r /opt/regen/requirements.txt -c /opt/regen/constraints.txt
COPY --chown=airflow:root include/ /opt/regen/include/
RUN pip install --no-cache-dir --no-deps /opt/regen
COPY --chown=airflow:root include/ /opt/airflow/include/
COPY --chown=airflow:root dags/ /opt/airflow/dags/
COPY --chown=airflow:root plugins/ /opt/airflow/plugins/
COPY --chown=airflow:root deploy/ /opt/airflow/deploy/
# The mounted include/ (compose mounts ./include here) comes before the installed copy.
ENV PYTHONPATH=/opt/airflow/include

FROM lmsysorg/sglang:v${SGLANG_VERSION} AS gpu
USER root
COPY requirements.txt constraints.txt pyproject.toml /opt/regen/
COPY include/ /opt/regen/include/
RUN useradd --uid 50000 --gid 0 --create-home --home-dir /home/airflow airflow \
    && python3 -m venv /opt/airflow-venv \
    && /opt/airflow-venv/bin/pip install --no-cache-dir -r /opt/regen/requirements.txt -c /opt/regen/constraints.txt \
    && /opt/airflow-venv/bin/pip install --no-cache-dir --no-deps /opt/regen \
    && mkdir -p /opt/airflow && chown -R airflow:root /opt/airflow
COPY --chown=airflow:root include/ /opt/airflow/include/
COPY --chown=airflow:root dags/ /opt/airflow/dags/
COPY --chown=airflow:root plugins/ /opt/airflow/plugins/
COPY --chown=airflow:root deploy/ /opt/airflow/deploy/
ENV PATH=/opt/airflow-venv/bin:$PATH AIRFLOW_HOME=/opt/airflow PYTHONPATH=/opt/airflow/include
USER airflow
WORKDIR /opt/airflow
# As the Airflow image's entrypoint does for a command: `celery worker ...` runs `airflow celery worker ...`.
ENTRYPOINT ["airflow"]
