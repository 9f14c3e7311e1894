"""End-to-end helpers that drive the real Airflow UI (see browser.py)."""
