"""Plan kinds beyond one text model: one rank of a distributed model, speculative decoding, and
``dispatch``, the one call that makes a plan of whichever kind a request asks for.
"""
