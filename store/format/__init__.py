"""kvwake.store.format: the store's on-disk formats (block files, byte planes, chain keys, the snapshot
digest). Every layout is documented in the module that writes it. Imports nothing else of kvwake.store."""
