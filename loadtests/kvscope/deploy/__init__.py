"""Stage 2, deployment: the model, the images, and the helpers the Ansible roles call (probe, stop, manifest)."""
