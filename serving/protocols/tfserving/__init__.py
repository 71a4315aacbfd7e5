"""TF-Serving's REST predict API: the JSON body (``codec``) and the predict route (``predict``)."""
