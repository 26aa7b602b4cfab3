"""The KDA CuTe DSL kernels, one class per module (``wide``, ``stream``, ``split``,
``replay``, ``recover``; ``device``: their shared device math), and ``launch``: the torch
ops' implementations (validate, choose, compile once, launch). Importing this package needs
no CuTe DSL; its kernel modules do."""
