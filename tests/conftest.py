"""Test-wide settings: quiet TensorFlow, keep W&B offline and inside temporary folders."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("WANDB_DISABLE_GIT", "true")
os.environ.setdefault("WANDB_CONSOLE", "off")
# No GPU here; make sure no test picks one up by accident on a developer's machine either.
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
