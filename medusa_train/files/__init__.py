"""File helpers with no domain knowledge: durable atomic writes (:mod:`.atomic`), checksums (:mod:`.checksums`),
streamed JSON and safetensors (:mod:`.json_stream`, :mod:`.safetensors_stream`), the UTF-8 reader of user files
(:mod:`.text_files`) and where the project finds its own files (:mod:`.paths`)."""
