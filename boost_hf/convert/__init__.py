"""Checkpoints written by other trainers, as canonical boost-hf checkpoints (``boost-hf convert``).

* :mod:`boost_hf.convert.boost_release`: the BOOST authors' Nanotron-based release (``Arcana-2236/BOOST``).

(A checkpoint of the CoLA authors' ``alvin-zyl/CoLA`` needs no conversion step: ``from_pretrained`` reads it.)
"""

from .boost_release import ReleaseCheckpointError, convert_boost_release, load_boost_release, read_boost_release

__all__ = ["ReleaseCheckpointError", "convert_boost_release", "load_boost_release", "read_boost_release"]
