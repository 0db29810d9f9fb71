"""Helpers run from the Makefile (tools/airflow_local.py: `make airflow`)."""
