"""The mailbox all-reduce's CuTe kernel (``tpcomm.allreduce`` is its host entry)."""
