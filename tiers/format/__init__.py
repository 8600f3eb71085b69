"""The on-disk vocabulary and format: what a checkpoint stores (records, the manifest, the rank index), how it
is written (frames in a data file, or HDF5; codecs; Python objects' encodings) and turned into bytes and back
(checksums, strict parsing), and the names its files take."""
