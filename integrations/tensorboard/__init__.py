"""lossscale_callbacks.tensorboard (integration under construction)."""
