#!/usr/bin/env bash
# What docker-compose.yaml's airflow-init does once, as root, before any other service starts:
#  - the secrets Airflow's services share (the JWT secret that signs the tokens a Celery worker's
#    task presents to the API server, the API's secret key, the Fernet key of connections), drawn at
#    random on the first `docker compose up` and kept in the airflow-secrets volume, which Airflow's
#    services read through AIRFLOW__..._CMD (no secret is written into the compose file); the
#    workers' volume (worker-secrets) gets a copy of the API's key only;
#  - the web login's password file (user airflow; password $_AIRFLOW_WWW_USER_PASSWORD, else drawn
#    here and printed once, in this service's log);
#  - the regen-keys volume (the servers' keys, only the GPU workers mount it) the workers' alone;
#  - the regen-data volume owned by the uid the workers run as (50000), and the demo model the
#    default DAG serves, built there unless it is already.
# Run again, it changes nothing that exists. Paths and the uid are variables so that the tests run it
# on a machine without Docker (tests/test_compose.py, tests/test_celery.py).
set -euo pipefail

SECRETS_DIR=${SECRETS_DIR:-/opt/airflow/secrets}
WORKER_SECRETS_DIR=${WORKER_SECRETS_DIR:-/opt/airflow/worker-secrets}
DATA_DIR=${DATA_DIR:-/data/regen}
KEYS_DIR=${KEYS_DIR:-/opt/airflow/regen-keys}
WORKER_UID=${WORKER_UID:-50000}
PYTHON=${PYTHON:-python}

mkdir -p "$SECRETS_DIR" "$WORKER_SECRETS_DIR" "$DATA_DIR"
chmod 0700 "$SECRETS_DIR" "$WORKER_SECRETS_DIR"
umask 077

draw() {  # draw FILE PYTHON-EXPRESSION: the file's secret, unless it has one
    local file="$SECRETS_DIR/$1"
    if [ ! -s "$file" ]; then
        "$PYTHON" -c "import secrets, base64; print($2)" > "$file.tmp"
        mv "$file.tmp" "$file"
        echo "airflow-init: drew $file"
    fi
}
draw jwt_secret "secrets.token_urlsafe(48)"
draw api_secret_key "secrets.token_urlsafe(48)"
draw fernet_key "base64.urlsafe_b64encode(secrets.token_bytes(32)).decode()"  # Fernet's key form
# The Celery workers' one secret: the API's key, which their log server checks requests with.
if ! cmp -s "$SECRETS_DIR/api_secret_key" "$WORKER_SECRETS_DIR/api_secret_key"; then
    cp "$SECRETS_DIR/api_secret_key" "$WORKER_SECRETS_DIR/api_secret_key.tmp"
    mv "$WORKER_SECRETS_DIR/api_secret_key.tmp" "$WORKER_SECRETS_DIR/api_secret_key"
fi
if [ ! -s "$SECRETS_DIR/passwords.json" ]; then
    # The password goes through the environment and a file, never a command line (ps would show it).
    if [ -z "${_AIRFLOW_WWW_USER_PASSWORD:-}" ]; then
        _AIRFLOW_WWW_USER_PASSWORD=$("$PYTHON" -c "import secrets; print(secrets.token_urlsafe(18))")
        drawn_password=1
    fi
    _AIRFLOW_WWW_USER_PASSWORD=$_AIRFLOW_WWW_USER_PASSWORD "$PYTHON" -c \
        'import json, os; print(json.dumps({"airflow": os.environ["_AIRFLOW_WWW_USER_PASSWORD"]}))' \
        > "$SECRETS_DIR/passwords.json.tmp"
    mv "$SECRETS_DIR/passwords.json.tmp" "$SECRETS_DIR/passwords.json"
    if [ -n "${drawn_password:-}" ]; then
        echo "airflow-init: the UI's login is airflow / $_AIRFLOW_WWW_USER_PASSWORD (drawn now, shown only this once;" \
             "it stays in the airflow-secrets volume, passwords.json)"
    fi
fi

if [ ! -f "$DATA_DIR/demo-model/config.json" ]; then
    regen demo-model --out "$DATA_DIR/demo-model" > /dev/null
    echo "airflow-init: built the demo model in $DATA_DIR/demo-model (regenerate_dataset serves it with the" \
         "simulator; for your model set model_path: /models/NAME and engine: sglang in deploy/dataset.yaml)"
fi

# The volume's top and what was made here; never a recursive walk of datasets that may be terabytes.
chown -R "$WORKER_UID:0" "$SECRETS_DIR" "$WORKER_SECRETS_DIR" "$DATA_DIR/demo-model"
chown "$WORKER_UID:0" "$DATA_DIR"
# The servers' keys: the GPU workers' user's alone (regen refuses a key folder others can read).
mkdir -p "$KEYS_DIR"
chown "$WORKER_UID:0" "$KEYS_DIR"
chmod 0700 "$KEYS_DIR"
echo "airflow-init: the UI is at http://127.0.0.1:8080 unless AIRFLOW_UI_BIND or AIRFLOW_UI_PORT say otherwise (user airflow)"
