"""rlaxkit: asynchronous, preemption-tolerant RL for language models in JAX.

Not DeepMind's ``rlax``: this package re-creates the RLAX parameter-server system and
AReaL's asynchronous RL, with a SimPy simulator of the fleet (``sim``).
"""

__version__ = "0.1.0"
