"""One parser module per vendor tool; each exposes pure ``parse…(text) -> list[ParsedChip]`` functions.

=================  ====================================================
module             tool and formats
=================  ====================================================
``nvidia_smi``     ``nvidia-smi`` ``--query-gpu`` CSV, ``-L``, plain, ``-q -x``
``ixsmi``          Iluvatar ``ixsmi`` (nvidia-smi clone)
``rocm_smi``       ``rocm-smi`` / ``hy-smi`` JSON, CSV, text, plain
``amd_smi``        ``amd-smi static``/``list`` text, GPU list, ``partition``
``rocminfo``       ``rocminfo`` agents
``npu_smi``        ``npu-smi info``, ``info -m``, ``info -t …``
``mx_smi``         MetaX ``mx-smi`` (all three table layouts)
``mthreads_gmi``   Moore Threads ``mthreads-gmi``
``cnmon``          Cambricon ``cnmon``
``efsmi``          Enflame ``efsmi``
``hl_smi``         Intel Gaudi ``hl-smi``
``lspci``          ``lspci`` (fallback for PCI data)
=================  ====================================================

Unknown or garbled input gives an empty list (or a ``ValueError`` that says
what did not fit), never an unrelated exception.
"""

from hetctl.probe.parsers._common import ParsedChip, is_masked, normalize_bdf

__all__ = ["ParsedChip", "is_masked", "normalize_bdf"]
