#!/bin/sh
# The container's entry point. `serve` runs `jaxstream serve` on 0.0.0.0:$PORT (default 8000), with the
# arguments after it; anything else runs as a jaxstream command (`docker run IMAGE transcribe FILE`).
#
# SageMaker hosting (AWS's contract for bring-your-own inference containers) starts the container as
# `docker run IMAGE serve`, with no way to pass arguments, calls it on port 8080 and copies the model's
# artifacts (CreateModel's ModelDataUrl or ModelDataSource, unpacked) to /opt/ml/model. So where that
# directory exists (nothing else creates it in this image), or SageMaker's variables are set, `serve`
# listens on $SAGEMAKER_BIND_TO_PORT (multi-container endpoints) or 8080, and without arguments serves the
# checkpoint in the model directory if it holds one (else the embedded model). $SM_MODEL_DIR, the SageMaker
# toolkits' name for that directory, overrides /opt/ml/model.
#
# A checkpoint is what `jaxstream serve DIR` loads: a directory with params.json (Mistral native), config.json
# (Hugging Face) or jaxstream.json (jaxstream Orbax), as models/loading.py recognises them. A model directory
# holding anything else (a tarball of only code/inference.py, as SageMaker's framework toolkits package
# them) is not one, and serving it failed at load: the embedded model is served instead, with a note.
set -e
if [ "$1" = "serve" ]; then
    shift
    model_dir="${SM_MODEL_DIR:-/opt/ml/model}"
    if [ -d "$model_dir" ] || [ -n "$SM_MODEL_DIR" ] || [ -n "$SAGEMAKER_BIND_TO_PORT" ]; then
        PORT="${SAGEMAKER_BIND_TO_PORT:-8080}"
        if [ "$#" -eq 0 ]; then
            if [ -f "$model_dir/params.json" ] || [ -f "$model_dir/config.json" ] \
                    || [ -f "$model_dir/jaxstream.json" ]; then
                set -- "$model_dir"
            elif [ -n "$(ls -A "$model_dir" 2>/dev/null)" ]; then
                echo "entrypoint: $model_dir holds no checkpoint (params.json, config.json or jaxstream.json):" \
                    "serving the embedded model" >&2
            fi
        fi
    fi
    exec jaxstream serve --host 0.0.0.0 --port "${PORT:-8000}" "$@"
fi
exec jaxstream "$@"
