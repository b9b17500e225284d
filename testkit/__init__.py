"""What tests/ and bench/ both run against: tiny models, a real daemon, stored KV, an S3 server, the load generator.

Importable from a repository checkout (its root on sys.path, as pytest and bench/ scripts set it); not part
of the installed `kvwake` package (docs/decisions.md, "The test kit").
"""
