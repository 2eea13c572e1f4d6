"""The choices of the detector's flags: --box_loss (`loss`) and --head_norm (`model`). Here, not in those modules,
because they import torch and a script's --help builds its parser without it.
"""

BOX_LOSSES = ("l1", "smooth_l1", "giou")  # --box_loss's choices (`loss`)
HEAD_NORMS = ("none", "gn")  # --head_norm's choices (`model`)
