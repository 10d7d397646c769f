"""How the HTTP app answers a failure: every error is an OpenAI error body, counted and logged."""

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from deployments import metrics, request_log
from deployments.errors import APIError, clip, validation_error


def error_response(e: APIError) -> JSONResponse:
    metrics.count_error(e.status_code, e.type)
    request_log.failed(e.status_code, e.type)
    return JSONResponse(e.body(), status_code=e.status_code, headers=e.headers())


def install_error_handlers(app: FastAPI) -> None:
    """APIError as is; FastAPI's validation and HTTP errors as 4xx naming what was wrong."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError):
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _invalid_body(request: Request, e: RequestValidationError):
        content_type = request.headers.get("content-type", "")
        if request.method == "POST" and "json" not in content_type:  # FastAPI then parses no body at all
            return error_response(
                APIError(
                    400,
                    "request body must be JSON sent with Content-Type: "
                    f"application/json (got {clip(content_type) or 'none'!r})",
                )
            )
        return error_response(validation_error(e.errors()))

    @app.exception_handler(HTTPException)
    async def _http_error(_: Request, e: HTTPException):
        message = str(e.detail)
        if e.__cause__ is not None:  # e.g. a body that is not UTF-8: say what FastAPI could not parse
            message += f": {type(e.__cause__).__name__}: {e.__cause__}"
        return error_response(APIError(e.status_code, message, code=str(e.status_code)))
