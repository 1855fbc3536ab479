"""Front ends users call besides wrap(): OffloadModel (offload_model/). Each builds on the runtime
and the mechanisms; front ends never import each other."""
