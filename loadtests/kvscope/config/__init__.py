"""Stage 1, configuration: the storage-config matrix and what a config renders into. Imports nothing of kvscope's."""
