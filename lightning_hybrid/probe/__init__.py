"""The setup probe: the model's blocks found by structure (:mod:`~.blocks`), the user's step run once at setup and
recorded (:mod:`~.record`, :mod:`~.step_probe`), and how each unit's output shapes follow its inputs
(:mod:`~.shapes`). Torch only: every part that plans from the record reads it from here. Import from the modules:
this package imports none of them."""
