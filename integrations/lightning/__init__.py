"""lossscale_callbacks.lightning (integration under construction)."""
