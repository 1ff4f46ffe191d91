/**
 * Tokenizer and chat template of a Hugging Face checkpoint: tokenizer.json
 * through @huggingface/tokenizers, the Jinja `chat_template` through
 * @huggingface/jinja, and a streaming decoder for token-by-token output
 * (text-stream.ts).
 */
import { Tokenizer } from '@huggingface/tokenizers';
import { Template } from '@huggingface/jinja';
import { z } from 'zod';
import { ModelFormatError } from './errors.ts';
import { StreamDecoder } from './text-stream.ts';

export interface ChatMessage {
  role: string;
  content: string;
}

export interface ChatTemplateOptions {
  addGenerationPrompt?: boolean;
  /** Extra variables for the template (e.g. `tools`, `date_string`). */
  extra?: Record<string, unknown>;
}

const TokenSpec = z.union([z.string(), z.object({ content: z.string() }).loose()]).nullable().optional();

const TokenizerConfigSchema = z
  .object({
    chat_template: z.union([z.string(), z.array(z.object({ name: z.string(), template: z.string() }))]).nullable().optional(),
    bos_token: TokenSpec,
    eos_token: TokenSpec,
    pad_token: TokenSpec,
    unk_token: TokenSpec,
    add_bos_token: z.boolean().nullable().optional(),
  })
  .loose();

const TokenizerJsonSchema = z.object({ model: z.object({ type: z.string() }).loose() }).loose();

function tokenText(spec: z.infer<typeof TokenSpec>): string | null {
  if (spec === null || spec === undefined) return null;
  return typeof spec === 'string' ? spec : spec.content;
}

function joinUrl(base: string, file: string): string {
  return base.endsWith('/') ? base + file : `${base}/${file}`;
}

async function fetchJson(fetchFn: typeof fetch, baseUrl: string, file: string, signal?: AbortSignal): Promise<unknown> {
  const res = await fetchFn(joinUrl(baseUrl, file), { signal });
  if (!res.ok) {
    await res.body?.cancel();
    throw new ModelFormatError(file, `HTTP ${res.status} from ${joinUrl(baseUrl, file)}`);
  }
  const text = await res.text();
  try {
    return JSON.parse(text);
  } catch (e) {
    throw new ModelFormatError(file, `not valid JSON (${(e as Error).message})`);
  }
}

const GenerationConfigSchema = z.object({ eos_token_id: z.union([z.number().int().nonnegative(), z.array(z.number().int().nonnegative())]).nullable().optional() }).loose();

/**
 * eos ids of generation_config.json: chat checkpoints list their end-of-turn
 * tokens there (Qwen3: <|im_end|> and <|endoftext|>; Llama 3.1: <|eot_id|>,
 * <|eom_id|>, <|end_of_text|>), often more than config.json does. The file is
 * optional (404: none); a malformed one is an error, not silently ignored.
 */
async function generationEosIds(fetchFn: typeof fetch, baseUrl: string, signal?: AbortSignal): Promise<number[]> {
  const res = await fetchFn(joinUrl(baseUrl, 'generation_config.json'), { signal });
  if (res.status === 404) {
    await res.body?.cancel();
    return [];
  }
  if (!res.ok) {
    await res.body?.cancel();
    throw new ModelFormatError('generation_config.json', `HTTP ${res.status} from ${joinUrl(baseUrl, 'generation_config.json')}`);
  }
  let json: unknown;
  try {
    json = JSON.parse(await res.text());
  } catch (e) {
    throw new ModelFormatError('generation_config.json', `not valid JSON (${(e as Error).message})`);
  }
  return generationConfigEosIds(json);
}

/** eos ids of a parsed generation_config.json (none when it lists none). */
export function generationConfigEosIds(json: unknown): number[] {
  const g = GenerationConfigSchema.safeParse(json);
  if (!g.success) throw new ModelFormatError('generation_config.json', `field "${g.error.issues[0]!.path.join('.')}": ${g.error.issues[0]!.message}`);
  const eos = g.data.eos_token_id;
  return eos === undefined || eos === null ? [] : Array.isArray(eos) ? eos : [eos];
}

export interface TokenizerLoadOptions {
  signal?: AbortSignal;
  /** eos ids from config.json, added to the tokenizer's own (load() adds generation_config.json's). */
  extraEosTokenIds?: readonly number[];
}

export class ModelTokenizer {
  readonly bosToken: string | null;
  readonly eosToken: string | null;
  readonly bosTokenId: number | null;
  /** Every id that ends generation (tokenizer eos + any given by the model config). */
  readonly eosTokenIds: readonly number[];
  private readonly inner: Tokenizer;
  private readonly template: Template | null;
  private readonly specialTokens: Record<string, string>;

  private constructor(tokenizerJson: unknown, tokenizerConfig: unknown, opts: TokenizerLoadOptions & { chatTemplate?: string | null }) {
    const tj = TokenizerJsonSchema.safeParse(tokenizerJson);
    if (!tj.success) throw new ModelFormatError('tokenizer.json', `field "${tj.error.issues[0]!.path.join('.')}": ${tj.error.issues[0]!.message}`);
    const tc = TokenizerConfigSchema.safeParse(tokenizerConfig);
    if (!tc.success) throw new ModelFormatError('tokenizer_config.json', `field "${tc.error.issues[0]!.path.join('.')}": ${tc.error.issues[0]!.message}`);
    try {
      this.inner = new Tokenizer(tokenizerJson as object, tokenizerConfig as object);
    } catch (e) {
      throw new ModelFormatError('tokenizer.json', `cannot build tokenizer: ${(e as Error).message}`);
    }
    const cfg = tc.data;
    this.bosToken = tokenText(cfg.bos_token);
    this.eosToken = tokenText(cfg.eos_token);
    this.bosTokenId = this.bosToken === null ? null : (this.inner.token_to_id(this.bosToken) ?? null);
    const eos = new Set<number>(opts.extraEosTokenIds ?? []);
    if (this.eosToken !== null) {
      const id = this.inner.token_to_id(this.eosToken);
      if (id === undefined) throw new ModelFormatError('tokenizer_config.json', `eos_token "${this.eosToken}" is not in the vocabulary`);
      eos.add(id);
    }
    this.eosTokenIds = [...eos];
    this.specialTokens = {};
    for (const key of ['bos_token', 'eos_token', 'pad_token', 'unk_token'] as const) {
      const t = tokenText(cfg[key]);
      if (t !== null) this.specialTokens[key] = t;
    }
    let source = opts.chatTemplate ?? null;
    if (source === null && cfg.chat_template) {
      source = typeof cfg.chat_template === 'string' ? cfg.chat_template : (cfg.chat_template.find((t) => t.name === 'default')?.template ?? cfg.chat_template[0]?.template ?? null);
    }
    try {
      this.template = source === null ? null : new Template(source);
    } catch (e) {
      throw new ModelFormatError('tokenizer_config.json', `chat_template does not parse: ${(e as Error).message}`);
    }
  }

  /** From already-parsed tokenizer.json and tokenizer_config.json. */
  static fromJson(tokenizerJson: unknown, tokenizerConfig: unknown, opts: TokenizerLoadOptions & { chatTemplate?: string | null } = {}): ModelTokenizer {
    return new ModelTokenizer(tokenizerJson, tokenizerConfig, opts);
  }

  /**
   * Fetch tokenizer.json and tokenizer_config.json from `baseUrl`; a
   * `chat_template.jinja` file (newer checkpoints) is used when the config
   * carries no template, and generation_config.json's eos ids stop
   * generation too.
   */
  static async load(fetchFn: typeof fetch, baseUrl: string, opts: TokenizerLoadOptions = {}): Promise<ModelTokenizer> {
    const [tj, tc] = await Promise.all([
      fetchJson(fetchFn, baseUrl, 'tokenizer.json', opts.signal),
      fetchJson(fetchFn, baseUrl, 'tokenizer_config.json', opts.signal),
    ]);
    let chatTemplate: string | null = null;
    if (typeof tc === 'object' && tc !== null && !(tc as { chat_template?: unknown }).chat_template) {
      const res = await fetchFn(joinUrl(baseUrl, 'chat_template.jinja'), { signal: opts.signal });
      if (res.ok) chatTemplate = await res.text();
      else await res.body?.cancel();
    }
    const genEos = await generationEosIds(fetchFn, baseUrl, opts.signal);
    return new ModelTokenizer(tj, tc, { ...opts, chatTemplate, extraEosTokenIds: [...(opts.extraEosTokenIds ?? []), ...genEos] });
  }

  get hasChatTemplate(): boolean {
    return this.template !== null;
  }

  /** Vocabulary size including added tokens. */
  get vocabSize(): number {
    return this.inner.get_vocab(true).size;
  }

  /** Text → ids. `addSpecialTokens` applies the post-processor (e.g. Llama 3's bos). */
  encode(text: string, opts: { addSpecialTokens?: boolean } = {}): number[] {
    return this.inner.encode(text, { add_special_tokens: opts.addSpecialTokens ?? true }).ids;
  }

  decode(ids: readonly number[], opts: { skipSpecialTokens?: boolean } = {}): string {
    // The library throws on an empty list; the stream decoder asks for empty windows.
    if (ids.length === 0) return '';
    const skip = opts.skipSpecialTokens ?? false;
    if (ids.length === 1) return this.decodeOne(ids[0]!, skip);
    // clean_up_tokenization_spaces off: it rewrites " ." and breaks streaming deltas.
    return this.inner.decode([...ids], { skip_special_tokens: skip, clean_up_tokenization_spaces: false });
  }

  /**
   * One id alone, remembered: a head's stream decoder decodes each new token
   * alone once per token of every chat (text-stream.ts), and the library's
   * decode costs tens of µs a call. Exact: a decode depends on the ids only.
   */
  private decodeOne(id: number, skip: boolean): string {
    const memo = skip ? this.singlesSkipping : this.singles;
    const known = memo.get(id);
    if (known !== undefined) return known;
    const text: string = this.inner.decode([id], { skip_special_tokens: skip, clean_up_tokenization_spaces: false });
    if (memo.size >= 65_536) memo.clear();
    memo.set(id, text);
    return text;
  }

  private readonly singles = new Map<number, string>();
  private readonly singlesSkipping = new Map<number, string>();

  tokenToId(token: string): number | undefined {
    return this.inner.token_to_id(token);
  }

  idToToken(id: number): string | undefined {
    return this.inner.id_to_token(id);
  }

  isEos(id: number): boolean {
    return this.eosTokenIds.includes(id);
  }

  applyChatTemplate(messages: readonly ChatMessage[], opts: ChatTemplateOptions = {}): string {
    if (!this.template) throw new ModelFormatError('tokenizer_config.json', 'checkpoint has no chat_template');
    return this.template.render({
      ...this.specialTokens,
      ...opts.extra,
      messages,
      add_generation_prompt: opts.addGenerationPrompt ?? false,
    });
  }

  /**
   * Prompt ids for a chat. The template writes bos itself where the model
   * wants it, so no special tokens are added again (as transformers does).
   */
  encodeChat(messages: readonly ChatMessage[], opts: ChatTemplateOptions = {}): number[] {
    return this.encode(this.applyChatTemplate(messages, { addGenerationPrompt: true, ...opts }), { addSpecialTokens: false });
  }

  streamDecoder(opts: { skipSpecialTokens?: boolean } = {}): StreamDecoder {
    return new StreamDecoder((ids) => this.decode(ids, opts));
  }
}
