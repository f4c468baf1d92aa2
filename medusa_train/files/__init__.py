"""File helpers with no domain knowledge: durable atomic writes (:mod:`.atomic`), whole folders published under a
temporary name and renamed or swapped into place (:mod:`.folders`), checksums (:mod:`.checksums`), streamed JSON and
safetensors (:mod:`.json_stream`, :mod:`.safetensors_stream`), the UTF-8 reader of user files (:mod:`.text_files`) and
where the project finds its own files (:mod:`.paths`)."""
