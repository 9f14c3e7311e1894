"""Airflow operators, hook and trigger for Changeover. Thin over the `changeover` core."""
