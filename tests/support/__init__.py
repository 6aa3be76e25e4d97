"""Helpers the tests share: paths, processes, test data, engines and Airflow deployments.

A plain package, not conftest, so a test names where a helper comes from and no test module
imports another test module.
"""
