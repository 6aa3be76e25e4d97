"""A node's inference servers: what was started (records), on which GPUs (gpus), starting and
stopping them (lifecycle), and the watchdog that outlives Airflow (watchdog)."""
