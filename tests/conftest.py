import os

from hypothesis import settings

from torchrec_lookahead.determinism import deterministic_cuda

settings.register_profile("ci", max_examples=300, deadline=None, derandomize=True)
settings.register_profile("dev", max_examples=100, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

deterministic_cuda()  # bitwise comparisons on a GPU (make gpu-check); nothing on the CPU
