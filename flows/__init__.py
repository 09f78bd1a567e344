"""Prefect flows: the pipeline (recipe → DAG of stage tasks) and the single-stage flow for work pools."""
