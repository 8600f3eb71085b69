"""The four stages a checkpoint's units flow through, one file each, in the order of the YAML chain.

``capture`` copies tensor bytes into host-cache slabs (what the trainer may wait for); ``serialize``
encodes the Python objects; ``compress`` may shrink a chunk's bytes; ``persist`` writes chunks into
this rank's data file on the durable tier. Each is a :class:`~pipeline.units.Stage` over the units of
pipeline/units.py; :mod:`.slabs` keeps the host-cache slabs a checkpoint holds between them. The job
(pipeline/job.py) builds them per checkpoint; lanes.py runs them on threads.
"""
