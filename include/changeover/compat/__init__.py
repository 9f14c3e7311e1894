"""Compatibility logic: what a job's new code and a new Spark version can take over from a savepoint.

`runtime.plan` describes a job's stages from their analysed plans inside the Spark runtime; `checker` compares that
description with a savepoint's manifest under the rules of `rules`, before anything running is touched.
"""
