"""The ways weights travel from a trainer to a vLLM server (:mod:`trainers.generation.vllm_server`'s
``WEIGHT_TRANSFERS``), by their config names. No torch here: GRPO's config section reads them."""

from __future__ import annotations

from typing import Literal

WeightTransferName = Literal["storage", "collective"]
# The weight transfers that load the model and its weights through a folder both sides read
# (``grpo.vllm_transfer_folder``); the others carry both themselves.
FOLDER_TRANSFERS = frozenset({"storage"})
