"""How `--compile` compiles: accelerate's TorchDynamoPlugin with torch.compile's automatic dynamic shapes.

Automatic dynamic shapes (`torch.compile(dynamic=None)`, torch's default): the first batch's shape compiles static, a
second one compiles with the sizes that changed symbolic, and that graph serves the later shapes (a side short enough
that a pyramid level is 1 cell gets a graph of its own). A data set of many padded batch shapes (aspect-ratio groups,
multi-scale training) compiles 2-4 times in all.

`accelerate launch` before accelerate 1.16 writes ACCELERATE_DYNAMO_USE_DYNAMIC=False into every process it starts
(its `--dynamo_use_dynamic` flag defaulted to False; huggingface/accelerate#4254), and TorchDynamoPlugin reads that as
`torch.compile(dynamic=False)`: a compilation for every new shape, each a pause of the whole forward and backward's
compile time (inductor: about 50 s for the built-in run's model on an H200), until dynamo's recompile limit (8) after
which new shapes run uncompiled. The plugin made here keeps torch's default whatever the launcher wrote.

The launcher also writes ACCELERATE_DYNAMO_BACKEND (and MODE) from an `accelerate config` with dynamo, which an
Accelerator given no plugin would apply to every script, evaluation and predict included, while config.yaml says
`compile: false`. `--compile` is the one switch: without it the plugin is made with backend "no" (said in one line
at start where the launcher asked for more).
"""

from __future__ import annotations


def dynamo_plugin(backend: str, mode: str = "default"):
    """accelerate's TorchDynamoPlugin for `backend` ("inductor", "aot_eager", "eager"; "no": not compiled) and
    inductor's `mode`, with automatic dynamic shapes."""
    from accelerate.utils import TorchDynamoPlugin

    plugin = TorchDynamoPlugin(backend=backend, mode=mode)
    plugin.dynamic = None  # after __post_init__, which sets it from ACCELERATE_DYNAMO_USE_DYNAMIC when that is set
    return plugin
