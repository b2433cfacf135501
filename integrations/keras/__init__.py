"""lossscale_callbacks.keras (integration under construction)."""
