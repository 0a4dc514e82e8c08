// The server's OpenAI API, as the page calls it: paths relative to the page (so it also works behind a proxy under a
// sub-path), the API key as a Bearer token, errors as the server's OpenAI error objects.

export class ApiError extends Error {
  constructor(message, status = 0, code = null) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

function headers(key) {
  const result = { "Content-Type": "application/json" };
  if (key) result.Authorization = `Bearer ${key}`;
  return result;
}

async function failure(response) {
  let message = `${response.status} ${response.statusText}`;
  let code = null;
  try {
    const { error } = await response.json();
    message = error.message || message;
    code = error.code ?? null;
  } catch {
    // not an OpenAI error object: the status line says what there is to say
  }
  return new ApiError(message, response.status, code);
}

/** The models the server serves (one). */
export async function listModels(key) {
  const response = await fetch("v1/models", { headers: headers(key) });
  if (!response.ok) throw await failure(response);
  return (await response.json()).data;
}

/** Stream the answer to `request` (a chat-completions body): yields each chunk; ends at [DONE]. Aborting `signal`
 * closes the connection, and the server stops the answer. */
export async function* streamChat(request, key, signal) {
  const body = JSON.stringify({ ...request, stream: true, stream_options: { include_usage: true } });
  const response = await fetch("v1/chat/completions", { method: "POST", headers: headers(key), body, signal });
  if (!response.ok) throw await failure(response);
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) throw new ApiError("the connection closed before the answer ended");
      buffer += value;
      let end;
      while ((end = /\r?\n\r?\n/.exec(buffer))) {
        const data = buffer.slice(0, end.index).split(/\r?\n/).filter((line) => line.startsWith("data:"))
          .map((line) => line.slice(5).replace(/^ /, "")).join("\n");
        buffer = buffer.slice(end.index + end[0].length);
        if (!data) continue;
        if (data === "[DONE]") return;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new ApiError(chunk.error.message, 0, chunk.error.code ?? null);
        yield chunk;
      }
    }
  } finally {
    reader.cancel().catch(() => {}); // a reader left early would keep the connection open
  }
}
