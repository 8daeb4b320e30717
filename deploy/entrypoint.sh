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
set -e
if [ "$1" = "serve" ]; then
    shift
    model_dir="${SM_MODEL_DIR:-/opt/ml/model}"
    if [ -d "$model_dir" ] || [ -n "$SM_MODEL_DIR" ] || [ -n "$SAGEMAKER_BIND_TO_PORT" ]; then
        PORT="${SAGEMAKER_BIND_TO_PORT:-8080}"
        if [ "$#" -eq 0 ] && [ -n "$(ls -A "$model_dir" 2>/dev/null)" ]; then
            set -- "$model_dir"
        fi
    fi
    exec jaxstream serve --host 0.0.0.0 --port "${PORT:-8000}" "$@"
fi
exec jaxstream "$@"
