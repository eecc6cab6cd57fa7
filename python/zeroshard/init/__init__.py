"""Meta-device initialisation internals: which initialiser runs for each module and in which order, Hugging Face's
``_init_weights`` order, and the constructors' random draws replayed at materialisation.

The user-facing modules of this layer stay at the top level: :mod:`zeroshard.meta_init` (``init_meta_context``,
``materialize_module_``) and :mod:`zeroshard.pretrained` (``load_pretrained``). The init layer may import
:mod:`zeroshard.sharding` (``pretrained``: the stage-3 placeholders); never the engine, offload, optim, checkpoint or
strategies.
"""
