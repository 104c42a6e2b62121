"""Pure ML: torch and transformers, no Prefect or MLflow. Packages by concern, each importing only
those before it in this order (tests/test_layers.py checks it):

- the ground: :mod:`.registry`, :mod:`.sections` (the stage section schema), :mod:`.lazy`;
- :mod:`.models`, :mod:`.data`, :mod:`.runtime`;
- :mod:`.scoring`, :mod:`.generation`;
- :mod:`.stages` (the stage spec an algorithm registers);
- one package per algorithm: :mod:`.sft`, :mod:`.dpo`, :mod:`.kto`, :mod:`.reward`, :mod:`.distill`,
  :mod:`.grpo` (none imports another);
- :mod:`.evaluation`;
- on top: :mod:`.catalog` (every stage registered) and :mod:`.plugins`.
"""
