"""The packer: buffers live over time ranges in, byte offsets in one arena out.

``problem`` states an allocation problem; ``greedy``, ``online``, ``coarsen``, ``skyline`` and
``search`` are its strategies; ``solve`` runs them within a budget; ``instances`` makes problems of
known optimum and ``csv_io`` reads and writes them as CSV (``dctms pack``); ``structure`` describes
an instance (its period, peaks, a window packed alone) to explain an arena above the bound;
``memo`` keeps ``solve``'s answers on disk for the compiler.
"""
