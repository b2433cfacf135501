"""A private room of the core: what a run tells the user about its overflows and its precision.

Nothing here is public and this package exports nothing. Inside: the gradient forensics (skip causes,
the layer where an overflow started, float16 headroom: ``_gradients``), the forward trace (activation
maxima against the compute dtype's range: ``_activations``), the precision advice built on both
(``_advice``) and the one set of words the summary, the sinks and ``report`` share (``_words``).
The integrations capture the numbers on the device; the rules and the words live here.
"""

__all__: list[str] = []
