"""A private room of the core: the scales of fp8 training, per layer and role, and what they tell.

Nothing here is public and this package exports nothing; users turn it on in their framework
(``lossscale_callbacks.keras.Fp8ScaleCallback``, ``lossscale_callbacks.torch.Fp8ScaleMonitor``). Inside:
the fp8 formats and what counts as saturated or underflowed (``_formats``), one read of every watched
tensor at the log interval and its metric names (``_reads``), the per-step rebuild of a delayed-scaling
history (``_delayed``), and the rules with their words (``_rules``). The integrations capture the numbers
on the device (torchao's casts, Keras' fp8 variables, TransformerEngine's ``fp8_meta``); the rules and the
words live here.
"""

__all__: list[str] = []
