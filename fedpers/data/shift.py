"""Joint-distribution shift for image data (FedGMM, Section 4.1, after FedEM).

Half of the data (``shift-fraction``) is transformed by ``T`` (90-degree rotation,
horizontal flip, inversion, or their composition) and its labels permuted by one fixed
random permutation, so that ``P_c(x)`` and ``P_c(y | x)`` both differ between the two
halves. The same transforms make the out-of-distribution test sets.
"""

from __future__ import annotations

import numpy as np

from fedpers.seeding import rng

TRANSFORMS = ("rot90", "flip", "invert")


def parse_transforms(spec: str) -> tuple[str, ...]:
    """``"rot90+flip"`` -> ``("rot90", "flip")``, checked against ``TRANSFORMS``."""
    names = tuple(part.strip() for part in spec.split("+") if part.strip())
    unknown = [n for n in names if n not in TRANSFORMS]
    if not names or unknown:
        raise ValueError(
            f"unknown image transform(s) {unknown or spec!r}; "
            f"combine {', '.join(TRANSFORMS)} with '+'"
        )
    return names


def transform_images(
    x: np.ndarray, names: tuple[str, ...], *, image_shape: tuple[int, ...], maximum: float
) -> np.ndarray:
    """Apply the named transforms to raw images (flat or channels-first).

    ``invert`` maps a raw value ``v`` to ``maximum - v``.
    """
    images = x.reshape((len(x), *image_shape))
    for name in names:
        if name == "rot90":
            images = np.rot90(images, k=1, axes=(-2, -1))
        elif name == "flip":
            images = images[..., ::-1]
        elif name == "invert":
            images = maximum - images
        else:
            raise ValueError(f"unknown image transform '{name}'")
    return np.ascontiguousarray(images).reshape(x.shape).astype(x.dtype)


def joint_shift(
    x: np.ndarray,
    y: np.ndarray,
    *,
    names: tuple[str, ...],
    fraction: float,
    num_classes: int,
    image_shape: tuple[int, ...],
    maximum: float,
    seed: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The shifted data set ``D1 u {(T(x), P(y)) : (x, y) in D2}``.

    Returns the new inputs, labels, and a boolean mask of the transformed samples.
    """
    generator = rng(seed, "joint-shift")
    shifted = np.zeros(len(y), dtype=bool)
    shifted[generator.permutation(len(y))[: int(round(fraction * len(y)))]] = True
    permutation = generator.permutation(num_classes)
    x_out, y_out = x.copy(), y.copy()
    x_out[shifted] = transform_images(x[shifted], names, image_shape=image_shape, maximum=maximum)
    y_out[shifted] = permutation[y[shifted]]
    return x_out, y_out, shifted
