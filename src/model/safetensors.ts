/**
 * safetensors over HTTP Range requests: a node fetches the header(s), then
 * only the byte ranges of the tensors it needs, coalesced into few requests.
 * The format itself (writing, header parsing, decoding) is safetensors-format.ts.
 */
import { ModelFetchError, ModelFormatError } from './errors.ts';
import { INDEX_FILE, IndexSchema, SINGLE_FILE, asSupportedDtype, decodeTensorBytes, parseSafetensorsHeader, readHeaderLength, type LoadOptions, type LoadedTensor, type OpenOptions, type RawTensor, type TensorInfo } from './safetensors-format.ts';

function joinUrl(base: string, file: string): string {
  return base.endsWith('/') ? base + file : `${base}/${file}`;
}

/** Consumes a response body from a known absolute file offset. */
class BodyCursor {
  private chunk: Uint8Array = new Uint8Array(0);
  private chunkPos = 0;
  private readonly reader: ReadableStreamDefaultReader<Uint8Array>;

  constructor(body: ReadableStream<Uint8Array>, public pos: number, private readonly file: string) {
    this.reader = body.getReader();
  }

  /** Copy the next `n` bytes into dst[at..]; `onBytes` sees each piece. Returns false at a premature end. */
  async read(dst: Uint8Array | null, at: number, n: number, onBytes?: (k: number) => void): Promise<boolean> {
    let done = 0;
    while (done < n) {
      if (this.chunkPos >= this.chunk.byteLength) {
        let r: ReadableStreamReadResult<Uint8Array>;
        try {
          r = await this.reader.read();
        } catch (e) {
          if ((e as Error).name === 'AbortError') throw e;
          throw new ModelFetchError(this.file, `download interrupted at byte ${this.pos}: ${(e as Error).message}`);
        }
        if (r.done) return false;
        this.chunk = r.value;
        this.chunkPos = 0;
        continue;
      }
      const k = Math.min(n - done, this.chunk.byteLength - this.chunkPos);
      if (dst) dst.set(this.chunk.subarray(this.chunkPos, this.chunkPos + k), at + done);
      this.chunkPos += k;
      done += k;
      this.pos += k;
      onBytes?.(k);
    }
    return true;
  }

  async skipTo(pos: number): Promise<boolean> {
    if (pos < this.pos) throw new Error(`${this.file}: cursor at ${this.pos} cannot go back to ${pos}`);
    return this.read(null, 0, pos - this.pos);
  }

  async cancel(): Promise<void> {
    try {
      await this.reader.cancel();
    } catch {
      // Already errored or closed: nothing left to release.
    }
  }
}

interface Fetched {
  cursor: BodyCursor;
  /** Server ignored Range and sent the whole file from offset 0. */
  ignoredRange: boolean;
  fileSize: number | null;
}

export interface ReaderStats {
  /** HTTP requests made (header and data). */
  requests: number;
  /** Body bytes consumed from responses (what actually crossed the wire, roughly). */
  bytesReceived: number;
  /** Requests sent again after a failed connection or a 502/503/504. */
  retries: number;
}

/** Tries per request, and the first wait between them (×4 each time: 0.25 s, 1 s). */
const FETCH_ATTEMPTS = 3;
const RETRY_DELAY_MS = 250;
const RETRY_STATUSES = new Set([502, 503, 504]);

function abortableDelay(ms: number, signal: AbortSignal | undefined, what: string): Promise<void> {
  return new Promise((resolve, reject) => {
    if (signal?.aborted) return reject(signal.reason instanceof Error ? signal.reason : new DOMException(what, 'AbortError'));
    const onAbort = () => {
      clearTimeout(t);
      reject(signal!.reason instanceof Error ? signal!.reason : new DOMException(what, 'AbortError'));
    };
    const t = setTimeout(() => {
      signal?.removeEventListener('abort', onAbort);
      resolve();
    }, ms);
    signal?.addEventListener('abort', onAbort, { once: true });
  });
}

/**
 * Reads tensors of a (possibly sharded) checkpoint from `baseUrl` with Range
 * requests through the injected `fetch`. Open with {@link SafetensorsReader.open}.
 */
export class SafetensorsReader {
  readonly stats: ReaderStats = { requests: 0, bytesReceived: 0, retries: 0 };
  /** Files whose server answered 200 to a Range request: correct, but every read streams from byte 0. */
  readonly rangeIgnoredFiles = new Set<string>();
  private readonly tensors = new Map<string, TensorInfo>();
  private readonly fileSizes = new Map<string, number | null>();
  private indexFile: string | null = null;

  private constructor(private readonly fetchFn: typeof fetch, readonly baseUrl: string) {}

  static async open(fetchFn: typeof fetch, baseUrl: string, opts: OpenOptions = {}): Promise<SafetensorsReader> {
    const r = new SafetensorsReader(fetchFn, baseUrl);
    await r.discover(opts);
    return r;
  }

  /** Every tensor of the checkpoint, by name. */
  get tensorInfos(): ReadonlyMap<string, TensorInfo> {
    return this.tensors;
  }

  /** Sorted: headers are read in parallel, so the order they arrive in is not the checkpoint's. */
  get files(): string[] {
    return [...this.fileSizes.keys()].sort();
  }

  has(name: string): boolean {
    return this.tensors.has(name);
  }

  info(name: string): TensorInfo {
    const t = this.tensors.get(name);
    if (!t) throw new ModelFormatError(this.indexFile ?? this.files.join(', '), 'tensor not found in checkpoint', name);
    return t;
  }

  /** Bytes a load of `names` would fetch, before coalescing. */
  tensorBytes(names: Iterable<string>): number {
    let n = 0;
    for (const name of new Set(names)) n += this.info(name).byteLength;
    return n;
  }

  private async discover(opts: OpenOptions): Promise<void> {
    let files = opts.files;
    if (!files) {
      const res = await this.request(INDEX_FILE, null, opts.signal);
      if (res.status === 404) {
        await res.body?.cancel();
        files = [SINGLE_FILE];
      } else {
        if (!res.ok) {
          await res.body?.cancel();
          throw new ModelFetchError(INDEX_FILE, `HTTP ${res.status} from ${joinUrl(this.baseUrl, INDEX_FILE)}`, res.status);
        }
        const text = await res.text();
        this.stats.bytesReceived += text.length;
        let json: unknown;
        try {
          json = JSON.parse(text);
        } catch (e) {
          throw new ModelFormatError(INDEX_FILE, `not valid JSON (${(e as Error).message})`);
        }
        const idx = IndexSchema.safeParse(json);
        if (!idx.success) throw new ModelFormatError(INDEX_FILE, `field "${idx.error.issues[0]!.path.join('.')}": ${idx.error.issues[0]!.message}`);
        this.indexFile = INDEX_FILE;
        files = [...new Set(Object.values(idx.data.weight_map))].sort();
        const headers = await Promise.all(files.map((f) => this.readHeader(f, opts)));
        for (const [tensor, file] of Object.entries(idx.data.weight_map)) {
          const t = headers[files.indexOf(file)]!.get(tensor);
          if (!t) throw new ModelFormatError(file, `listed in ${INDEX_FILE} but absent from the file's header`, tensor);
        }
        headers.forEach((h) => h.forEach((t, name) => this.tensors.set(name, t)));
        return;
      }
    }
    const headers = await Promise.all(files.map((f) => this.readHeader(f, opts)));
    for (const h of headers) {
      for (const [name, t] of h) {
        const prev = this.tensors.get(name);
        if (prev) throw new ModelFormatError(t.file, `also present in ${prev.file}`, name);
        this.tensors.set(name, t);
      }
    }
  }

  /**
   * One GET, tried again after a short wait when no answer came (the
   * connection failed) or the server said it is briefly unable (502/503/504):
   * a weight server under load drops connections now and then, and a node
   * that gave up on its span at the first one would leave its layers bare.
   */
  private async request(file: string, range: [number, number | null] | null, signal: AbortSignal | undefined): Promise<Response> {
    const headers: Record<string, string> = {};
    if (range) headers.Range = `bytes=${range[0]}-${range[1] === null ? '' : range[1] - 1}`;
    for (let attempt = 1; ; attempt++) {
      this.stats.requests++;
      let why: string;
      try {
        const res = await this.fetchFn(joinUrl(this.baseUrl, file), { headers, signal });
        if (!RETRY_STATUSES.has(res.status) || attempt >= FETCH_ATTEMPTS) return res;
        await res.body?.cancel();
        why = `HTTP ${res.status}`;
      } catch (e) {
        if ((e as Error).name === 'AbortError') throw e;
        why = (e as Error).message;
        if (attempt >= FETCH_ATTEMPTS) throw new ModelFetchError(file, `fetch failed (${attempt} attempts): ${why}`);
      }
      this.stats.retries++;
      await abortableDelay(RETRY_DELAY_MS * 4 ** (attempt - 1), signal, `${file}: ${why}`);
    }
  }

  /** GET bytes [start, end) of `file` (end null = to EOF); tolerates servers that ignore Range. */
  private async fetchRange(file: string, start: number, end: number | null, signal: AbortSignal | undefined): Promise<Fetched> {
    const res = await this.request(file, [start, end], signal);
    if (res.status === 416) {
      await res.body?.cancel();
      throw new ModelFormatError(file, `server cannot satisfy bytes ${start}-${end === null ? '' : end - 1} (416): file shorter than its header says`);
    }
    if (!res.ok) {
      await res.body?.cancel();
      throw new ModelFetchError(file, `HTTP ${res.status} from ${joinUrl(this.baseUrl, file)}`, res.status);
    }
    if (!res.body) throw new ModelFormatError(file, 'response has no body');
    const counted = res.body.pipeThrough(
      new TransformStream<Uint8Array, Uint8Array>({
        transform: (chunk, ctl) => {
          this.stats.bytesReceived += chunk.byteLength;
          ctl.enqueue(chunk);
        },
      }),
    );
    if (res.status === 206) {
      const cr = res.headers.get('content-range');
      // Content-Range is absent when a cross-origin server does not expose it: trust the request then.
      const m = cr ? /^bytes (\d+)-(\d+)\/(\d+|\*)$/.exec(cr.trim()) : null;
      if (cr && !m) throw new ModelFormatError(file, `malformed Content-Range "${cr}"`);
      if (m && Number(m[1]) !== start) throw new ModelFormatError(file, `asked for bytes from ${start}, server sent from ${m[1]}`);
      const fileSize = m && m[3] !== '*' ? Number(m[3]) : null;
      return { cursor: new BodyCursor(counted, start, file), ignoredRange: false, fileSize };
    }
    this.rangeIgnoredFiles.add(file);
    const len = res.headers.get('content-length');
    const cursor = new BodyCursor(counted, 0, file);
    return { cursor, ignoredRange: true, fileSize: len !== null && /^\d+$/.test(len) ? Number(len) : null };
  }

  private async readHeader(file: string, opts: OpenOptions): Promise<Map<string, TensorInfo>> {
    const prefetch = Math.max(8, opts.headerPrefetchBytes ?? 32 * 1024);
    const first = await this.fetchRange(file, 0, prefetch, opts.signal);
    let fileSize = first.fileSize;
    const head = new Uint8Array(8);
    if (!(await first.cursor.read(head, 0, 8))) {
      await first.cursor.cancel();
      throw new ModelFormatError(file, `truncated: fewer than 8 bytes`);
    }
    let headerLength: number;
    try {
      headerLength = readHeaderLength(head, file, fileSize);
    } catch (e) {
      await first.cursor.cancel();
      throw e;
    }
    const json = new Uint8Array(headerLength);
    // What the first response still holds: up to the prefetch size, or everything if Range was ignored.
    const inFirst = first.ignoredRange ? headerLength : Math.min(headerLength, prefetch - 8);
    const ok = await first.cursor.read(json, 0, inFirst);
    await first.cursor.cancel();
    if (!ok) throw new ModelFormatError(file, `truncated: header claims ${headerLength} bytes, file ends sooner`);
    if (inFirst < headerLength) {
      const rest = await this.fetchRange(file, 8 + inFirst, 8 + headerLength, opts.signal);
      fileSize ??= rest.fileSize;
      if (rest.ignoredRange && !(await rest.cursor.skipTo(8 + inFirst))) throw new ModelFormatError(file, 'truncated header');
      const ok2 = await rest.cursor.read(json, inFirst, headerLength - inFirst);
      await rest.cursor.cancel();
      if (!ok2) throw new ModelFormatError(file, `truncated: header claims ${headerLength} bytes, file ends sooner`);
    }
    this.fileSizes.set(file, fileSize);
    return parseSafetensorsHeader(json, file, fileSize);
  }

  /**
   * Fetch the stored bytes of `names`: per file, tensors sorted by offset and
   * neighbours within `maxGapBytes` merged into one Range request.
   */
  async fetchTensorBytes(names: Iterable<string>, opts: LoadOptions = {}): Promise<Map<string, RawTensor>> {
    const wanted = [...new Set(names)].map((n) => this.info(n));
    for (const t of wanted) asSupportedDtype(t);
    const maxGap = opts.maxGapBytes ?? 256 * 1024;
    const byFile = new Map<string, TensorInfo[]>();
    for (const t of wanted) {
      const list = byFile.get(t.file) ?? [];
      list.push(t);
      byFile.set(t.file, list);
    }
    interface Group { start: number; end: number; tensors: TensorInfo[] }
    const plan: Array<{ file: string; groups: Group[] }> = [];
    let total = 0;
    for (const [file, list] of byFile) {
      list.sort((a, b) => a.offset - b.offset);
      const groups: Group[] = [];
      for (const t of list) {
        const g = groups[groups.length - 1];
        if (g && t.offset - g.end <= maxGap) {
          g.end = Math.max(g.end, t.offset + t.byteLength);
          g.tensors.push(t);
        } else groups.push({ start: t.offset, end: t.offset + t.byteLength, tensors: [t] });
      }
      for (const g of groups) total += g.end - g.start;
      plan.push({ file, groups });
    }
    let loaded = 0;
    const progress = (k: number): void => {
      loaded += k;
      opts.onProgress?.(loaded, total);
    };
    opts.onProgress?.(0, total);
    const out = new Map<string, RawTensor>();
    // Files in parallel (they may live on different CDN nodes); ranges of one file in order.
    await Promise.all(
      plan.map(async ({ file, groups }) => {
        let shared: Fetched | null = null;
        try {
          for (const g of groups) {
            // Once a server has ignored Range, keep reading its single full-file stream forward.
            const f: Fetched = shared ?? (await this.fetchRange(file, g.start, g.end, opts.signal));
            if (f.ignoredRange) {
              shared = f;
              if (!(await f.cursor.skipTo(g.start))) throw new ModelFormatError(file, `truncated: file ends before byte ${g.start}`, g.tensors[0]!.name);
            }
            const buf = new Uint8Array(g.end - g.start);
            if (!(await f.cursor.read(buf, 0, buf.byteLength, progress))) {
              const at = f.cursor.pos;
              const culprit = g.tensors.find((t) => t.offset + t.byteLength > at) ?? g.tensors[0]!;
              throw new ModelFormatError(file, `truncated: data ends at byte ${at}, tensor needs ${culprit.offset}..${culprit.offset + culprit.byteLength}`, culprit.name);
            }
            if (!f.ignoredRange) await f.cursor.cancel();
            for (const t of g.tensors) {
              out.set(t.name, { name: t.name, file, dtype: asSupportedDtype(t), shape: t.shape, bytes: buf.subarray(t.offset - g.start, t.offset - g.start + t.byteLength) });
            }
          }
        } finally {
          if (shared) await shared.cursor.cancel();
        }
      }),
    );
    return out;
  }

  /** Fetch and decode `names` to float32. */
  async loadTensors(names: Iterable<string>, opts: LoadOptions = {}): Promise<Map<string, LoadedTensor>> {
    const raw = await this.fetchTensorBytes(names, opts);
    const out = new Map<string, LoadedTensor>();
    for (const [name, r] of raw) out.set(name, decodeTensorBytes(r));
    return out;
  }
}

export function openSafetensors(fetchFn: typeof fetch, baseUrl: string, opts?: OpenOptions): Promise<SafetensorsReader> {
  return SafetensorsReader.open(fetchFn, baseUrl, opts);
}
