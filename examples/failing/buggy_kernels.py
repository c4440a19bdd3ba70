"""Deliberately buggy kernels: ``equiv check examples/failing/`` must fail on each.

Kept out of ``equiv check examples/`` (sub-folders are not searched) so the main job stays green.
"""

import torch

from equiv import equivalent_to


def scale_ref(x, w):
    return x * w


@equivalent_to(scale_ref)
def scale_stale(x, w):
    """Wrong gradient: saves ``w`` then overwrites it through ``.data`` (no version bump)."""
    y = x * w
    w.data.mul_(1.0)  # a no-op write that autograd cannot see...
    w.data.add_(0.5)  # ...and one that changes the saved value behind autograd's back
    return y
