import os

import torch
from hypothesis import settings

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
settings.register_profile("affdiv", deadline=None, max_examples=25, derandomize=False)
settings.load_profile("affdiv")
