/**
 * Byte-level BPE in the GPT-2 style, trained at fixture-generation time so the
 * fixture tokenizer is a real one (the same code paths as SmolLM2 or Qwen2 in
 * @huggingface/tokenizers), not a lookup table that hides bugs.
 */

/** GPT-2's reversible byte → printable-unicode map (what ByteLevel uses). */
export function bytesToUnicode(): string[] {
  const printable: number[] = [];
  for (let b = 0x21; b <= 0x7e; b++) printable.push(b);
  for (let b = 0xa1; b <= 0xac; b++) printable.push(b);
  for (let b = 0xae; b <= 0xff; b++) printable.push(b);
  const table: string[] = new Array<string>(256);
  let next = 0;
  for (let b = 0; b < 256; b++) {
    if (printable.includes(b)) table[b] = String.fromCharCode(b);
    else table[b] = String.fromCharCode(256 + next++);
  }
  return table;
}

/** The ByteLevel pre-tokenizer's split (GPT-2 regex). */
export const GPT2_SPLIT = /'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+/gu;

export interface BpeModel {
  /** Byte symbols (256) followed by merged tokens, in id order. */
  tokens: string[];
  merges: Array<[string, string]>;
}

/**
 * Train merges until `tokens.length === targetTokens` (or the texts run out
 * of pairs). `weights[i]` multiplies the counts of `texts[i]`, so a filler
 * text weighted low only contributes once the main corpus is exhausted. Ties
 * break on the pair's string order: the result is a pure function of the inputs.
 */
export function trainBpe(texts: readonly string[], targetTokens: number, weights: readonly number[] = []): BpeModel {
  const byteChar = bytesToUnicode();
  const enc = new TextEncoder();
  const wordCounts = new Map<string, number>();
  for (const [t, text] of texts.entries()) {
    const weight = weights[t] ?? 1;
    for (const m of text.matchAll(GPT2_SPLIT)) {
      const mapped = Array.from(enc.encode(m[0]), (b) => byteChar[b]!).join('');
      wordCounts.set(mapped, (wordCounts.get(mapped) ?? 0) + weight);
    }
  }
  const words: string[][] = [];
  const counts: number[] = [];
  for (const [w, c] of [...wordCounts].sort((a, b) => (a[0] < b[0] ? -1 : a[0] > b[0] ? 1 : 0))) {
    words.push(Array.from(w));
    counts.push(c);
  }

  const SEP = '\u0000';
  const pairCount = new Map<string, number>();
  const pairWords = new Map<string, Set<number>>();
  const addWord = (i: number, sign: 1 | -1): void => {
    const w = words[i]!;
    for (let j = 0; j + 1 < w.length; j++) {
      const key = w[j]! + SEP + w[j + 1]!;
      const c = (pairCount.get(key) ?? 0) + sign * counts[i]!;
      if (c === 0) pairCount.delete(key);
      else pairCount.set(key, c);
      if (sign > 0) {
        let s = pairWords.get(key);
        if (!s) pairWords.set(key, (s = new Set()));
        s.add(i);
      }
    }
  };
  for (let i = 0; i < words.length; i++) addWord(i, 1);

  const tokens = [...byteChar];
  const known = new Set(tokens);
  const merges: Array<[string, string]> = [];
  while (tokens.length < targetTokens) {
    let best: string | null = null;
    let bestCount = 0;
    for (const [key, c] of pairCount) {
      if (c > bestCount || (c === bestCount && best !== null && key < best)) {
        best = key;
        bestCount = c;
      }
    }
    if (best === null) break;
    const [a, b] = best.split(SEP) as [string, string];
    merges.push([a, b]);
    const merged = a + b;
    if (!known.has(merged)) {
      known.add(merged);
      tokens.push(merged);
    }
    for (const i of pairWords.get(best) ?? []) {
      const w = words[i]!;
      addWord(i, -1);
      const out: string[] = [];
      for (let j = 0; j < w.length; j++) {
        if (j + 1 < w.length && w[j] === a && w[j + 1] === b) {
          out.push(merged);
          j++;
        } else out.push(w[j]!);
      }
      words[i] = out;
      addWord(i, 1);
    }
    pairWords.delete(best);
  }
  return { tokens, merges };
}

/**
 * Training text for the fixture tokenizer: plain English about the things
 * this project does, so merges look like real ones (" the", "ing", " model").
 */
export const FIXTURE_CORPUS = `
The mesh is a group of ordinary computers that share the work of running a large language model.
Each volunteer opens a web page, and the page downloads only the layers it has been asked to hold.
When a request arrives, the first node turns the prompt into tokens, looks up their embeddings, and
runs its layers. It then sends the hidden state to the next node, which runs the next layers, and so
on until the last node computes the logits and picks the next token. The answer streams back one
token at a time, like water moving through a series of pipes.

A good tracker keeps a map of which nodes are alive, how fast they are, and which layers they hold.
It chooses a route through the mesh that covers every layer, prefers fast links, and avoids nodes
that have been slow or silent. If a node disappears in the middle of a conversation, the head of the
route asks for a replacement, replays the history so the new node can rebuild its cache, and goes
on without skipping a single word. Nobody should notice anything except a short pause.

Weights are stored in files called safetensors. A small header describes every tensor: its name, its
shape, its data type, and where its bytes begin and end. Because the header comes first, a browser
can read it with one small request and then ask the server for exactly the byte ranges it needs.
Brain floating point numbers keep the range of single precision with fewer bits of mantissa, which
halves the download while losing very little accuracy.

In the kitchen, the recipe for bread is simple: flour, water, salt, and yeast. Mix them together,
knead the dough for ten minutes, let it rise in a warm place for about an hour, then shape it and
bake it in a hot oven until the crust is brown and the loaf sounds hollow when you tap the bottom.
Fresh bread is best eaten the same day, but it also makes wonderful toast the next morning.

The weather changed quickly that afternoon. Dark clouds rolled over the hills, the wind picked up,
and heavy rain began to fall on the fields and the quiet village roads. Children ran home from school
with their coats over their heads, laughing and splashing through the puddles. By evening the storm
had passed, the sky cleared, and the first stars appeared above the wet, shining rooftops.

Learning to play an instrument takes patience. Practice a little every day rather than a lot once a
week. Listen carefully to the sound you make, notice what your hands are doing, and slow down when a
passage feels difficult. Musicians often say that the most important skill is listening, because you
cannot improve what you do not hear. Playing with other people teaches timing and humility.

Questions and answers: What is a token? A token is a small piece of text, often a word or part of a
word. Why do models use tokens instead of letters? Because common words and pieces of words appear so
often that giving them their own symbols makes sequences shorter and learning easier. How many tokens
are in a sentence? It depends on the vocabulary, but English averages a little more than one token per
word. Numbers like 42, 1024, 3.14159 and 2025 are split into digits and groups of digits.

Some people garden for food, and some garden for beauty. Tomatoes need sun, regular water, and a stake
to climb. Roses want rich soil and careful pruning in early spring. Herbs such as basil, mint, thyme,
and rosemary grow happily in small pots near a bright window. A garden changes with every season,
and there is always something new to plant, to watch, or to learn from a mistake made last year.

The history of computing is full of surprising turns. Early machines filled entire rooms and used
thousands of vacuum tubes. Transistors made computers smaller, faster, and far more reliable. Later,
integrated circuits put millions and then billions of transistors on a single chip. Today a phone in
your pocket is more powerful than the computers that guided astronauts to the moon and back home.

"Hello," she said. "Are you coming with us to the market tomorrow?" He smiled and nodded. "I wouldn't
miss it. We'll need apples, cheese, eggs, and honey, and I've heard there's a new bakery near the
river." They agreed to meet at nine o'clock by the old stone bridge, where the path turns toward town.
`;

/** Extra training text used only when the corpus alone cannot fill a large vocabulary. */
export function fillerCorpus(): string {
  const parts: string[] = [];
  for (let i = 0; i < 1000; i++) parts.push(` ${i}`, ` ${(i * 7919) % 100000}`);
  return parts.join('');
}
