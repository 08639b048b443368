"""attncc inside other libraries. Each integration is a submodule that imports its library:

    attncc.integrations.transformers   Hugging Face transformers' attn_implementation="attncc"
                                       (pip install 'attncc[hf]')
"""
