"""What runs the course, apart from what it teaches.

``launch`` starts a script under torchrun or as one plain process from a notebook,
a test or the shell (with :mod:`.jobs`, :mod:`.failures`, :mod:`.ports`,
:mod:`.loopback` and :mod:`.forked_ranks` behind it); ``multinode``, ``netns`` and
``slurm`` launch jobs that span several nodes; ``cli`` is ``python -m ddp_course``;
``gpu_check`` runs the course on a GPU machine; ``notebook`` holds the helpers every
lesson's cells use.
"""
