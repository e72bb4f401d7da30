"""strata-nb: a Numba-compiled runtime for Mixture-of-Experts language models stored as GGUF files."""
from strata_nb import _numba_env

_numba_env.configure()

__version__ = "0.1.0"
