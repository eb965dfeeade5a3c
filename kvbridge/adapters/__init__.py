"""Everything with I/O: ZMQ, capture files and the Dynamo sinks."""
