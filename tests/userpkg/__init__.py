"""A user's own package, outside trainscale: models and data that tests and benchmarks give by import path
(``--model tests.userpkg.nets:tiny``, ``--dataset tests.userpkg.data:tensors``), and an optimizer
(``--optimizer tests.userpkg.opt:Plain``)."""
