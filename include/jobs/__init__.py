"""PySpark jobs that Changeover runs. Each module has build(spark, ctx) -> stages, or run(spark, ctx)."""
