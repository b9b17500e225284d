"""kvwake.store.remote: the shared tier on an S3-compatible object store (the layout is in client.py).

Stands on the local store's core (kvwake.store.core), never on the Store facade.
"""
